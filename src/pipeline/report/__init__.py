"""The comparison report: one self-contained HTML page that says which backend and precision
to train with on this machine, with every benchmark, run, evaluation and profile behind it.

The flow, one module per step:
  load.py        the results folder read into records and pandas frames, each file checked
  decisions.py   what the measurements say: the recommended setting, AMP policy verdicts
  formatting.py  numbers and labels as shown (also the templates' Jinja2 filters)
  charts.py      matplotlib figures as inline PNGs
  render.py      view models for the templates/ (Jinja2, autoescaped) and the page itself

No torch here: the report must start fast and run where no accelerator (or no torch) is.
"""
