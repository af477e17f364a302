"""One summary per pipeline run (results/summary.json): the decisions made once, which the
report and `python -m pipeline compare` both show.

  load.py         the results folder read into records and pandas frames, each file checked
  decisions.py    what the measurements say: the recommended setting, AMP policy verdicts,
                  flags, whether a reduced precision kept the accuracy
  build.py        the summary document, checked against schemas/summary.schema.yaml
  trained_runs.py each trained run's entry: how it trained, its time, scores and evaluation
  annotations.py  a user's data set identified by its annotation files' digests, not paths
  read.py         a summary file read back, or one paragraph saying why it cannot be

No torch here: summarising runs where no accelerator (or no torch) is.
"""
