"""Importing this module registers every stage that exists (see pipeline.spec.STAGES)."""
