"""The declared pipeline: stages, their validation and the runner.

::

    config -> catalog -> topology -> device -> plan -> preflight      (prepare: allocates nothing)
      -> fastload -> placement -> replication -> pin -> engine -> warmup -> serve   (stages, as declared)

Importing :mod:`pipeline.stages` registers every stage that exists; the runner refuses any
stage name it does not know, and any list in which a stage reads a context field before the
prepare step or an earlier stage writes it (pipeline.spec).
"""
