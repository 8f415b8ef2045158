"""The declared pipeline: stages, their validation and the runner.

::

    config -> catalog -> topology -> plan -> preflight            (prepare: allocates nothing)
      -> fastload -> placement -> replication -> pin -> warmup -> serve   (stages, as declared)

Importing :mod:`pipeline.stages` registers every stage that exists; the runner refuses any
stage name it does not know.
"""
