"""The stream processors: raw events in; StepMetrics, RunStepMetrics and alerts out.

Public entry points:

- ``stream``: the processors over a stream of raw messages, without Kafka
  (``figures``, ``StepFigures``, ``RunFigures``); offline replay, the report and export
  use it.
- ``runtime.Processor``: the live processors, exactly once through Kafka (``checkpoint``),
  with their health metrics (``health``).
- The step model, for code that needs a closed step's events rather than its figures (the
  timeline sink): ``model.StepEvents``, ``assembler.RankAssembler`` (one rank's raw
  batches -> its closed steps), and the one module per figure family that ``figures``
  calls (``steptrace``, ``utilization``, ``intervals``, ...).
"""
