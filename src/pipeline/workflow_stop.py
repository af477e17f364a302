"""A user's error found while Snakemake plans the workflow's jobs, said as the CLI says it: one
paragraph and a non-zero exit, without a traceback (workflow/rules/common.smk uses this).

Snakemake wraps whatever an input function raises in an InputFunctionException, printed with the
rule, the wildcards and a traceback, whatever its type (a WorkflowError too: rules.py catches
Exception). SystemExit is what it lets through. So the paragraph goes to Snakemake's log and
SystemExit(1) ends the run: while Snakemake builds the job graph (env.json already there) before
any job starts; after a checkpoint job of this run (env.json just written), through Snakemake's
scheduler, which takes it for an interrupt: it cancels running jobs and adds its own lines
('Terminating processes on user request', 'At least one job did not complete successfully').
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from snakemake.logging import logger

from pipeline.errors import PipelineError, user_message

P = ParamSpec("P")
R = TypeVar("R")


def stops_the_workflow(function: Callable[P, R]) -> Callable[P, R]:
    """`function` (a helper of input functions), with a PipelineError it raises (an absent
    backend the config asks for, say) logged as its paragraph and turned into SystemExit(1)."""

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except PipelineError as error:
            logger.error(user_message(error))
            raise SystemExit(1) from None

    return checked
