"""The comparison report: one self-contained HTML page that says which backend and precision
to train with on this machine, with every benchmark, run, evaluation and profile behind it.
It shows a summary (pipeline.summary, where the decisions are made) and draws its charts,
images and profile from the results folder.

One module per step:
  bench_views.py  view models of the answer, the benchmarks and the AMP policy
  run_views.py    view models of training, evaluation and the inference profile
  formatting.py   numbers and labels as shown (also the templates' Jinja2 filters)
  charts.py       matplotlib figures as inline PNGs
  templating.py   the templates/ (Jinja2, autoescaped) and the stylesheet
  render.py       the page itself

No torch here: the report must start fast and run where no accelerator (or no torch) is.
"""
