# Shared helpers: config validation, the job matrix and input functions of every stage.
import json
import os
import sys

from snakemake.exceptions import IncompleteCheckpointException, WorkflowError

# in .smk code a line starting with `report` is the report directive: the function by another name
from snakemake.io import report as report_file

from pipeline import config as pipeline_config
from pipeline import import_graph, measured, runs, setting_groups
from pipeline.data import carved_splits, has_test_split, split_files
from pipeline.data.image_files import find_images
from pipeline.errors import ConfigError
from pipeline.workflow_stop import stops_the_workflow


def config_layers():
    """What Snakemake merged into `config`, in its order: the configfile directive's file
    (unless --replace-workflow-config), each --configfile, then --config."""
    settings = workflow.config_settings
    given = [os.path.abspath(path) for path in settings.configfiles]
    own = [
        path
        for path in workflow.configfiles
        if os.path.abspath(path) not in given and not settings.replace_workflow_config
    ]
    layers = [pipeline_config.Layer.from_file(path) for path in [*own, *given]]
    if settings.config:
        layers.append(
            pipeline_config.Layer(pipeline_config.COMMAND_LINE, dict(settings.config))
        )
    return layers


# The package's validator, as the CLI's: a bad value stops the workflow before any job with
# one paragraph naming the file it came from (jsonschema's own error would print the schema).
try:
    config.update(pipeline_config.validate_layers(config_layers(), merged=config))
    # a split both given and carved (data.val_fraction, data.test_fraction): before any job
    carved_splits(config)
except ConfigError as error:
    sys.exit(str(error))


wildcard_constraints:
    backend="cpu|cuda|mps",
    precision="fp32|fp16|bf16",
    mode="train|infer",
    run=r"(cpu|mps|cuda\d*)-(fp32|fp16|bf16)(\+[^/]+)?",


ENV_JSON = "results/env.json"
# the choose_precision checkpoint's output, which measured runs and run_files' readers need
CHOICE_JSON = "results/choice/{backend}.json"
# as pipeline.data reads it: no shell expands `~` in a config value
DATA_ROOT = os.path.expanduser(config["data"]["root"])


# the package's sources as this workflow's working directory sees them (src/pipeline from the
# repository's root), read once here: each rule's code inputs are what its command imports
PACKAGE_SOURCES = os.path.relpath(
    os.path.join(workflow.basedir, "..", "src", "pipeline")
)


def command_sources(command):
    """The source files `python -m pipeline COMMAND` runs (its modules' import closure within
    the package, and the templates, stylesheets and schemas they read), as a stage's inputs:
    editing one reruns every stage whose command imports it, and no other."""
    return import_graph.command_sources(command, PACKAGE_SOURCES)


def without_compare(settings):
    """`settings` less the compare list: the summaries results/compare.html sets side by side
    are no part of this run's summary or report, and naming them reruns neither."""
    return {key: value for key, value in settings.items() if key != "compare"}


def results_config():
    """The config as summarize and report are told it (their params: a change reruns them)."""
    return json.dumps(without_compare(config), sort_keys=True)


def invocation():
    """How this workflow was called: its --configfile files (relative to the working directory
    when inside it) and --config settings, so the report's commands can repeat them."""
    settings = workflow.config_settings
    files = []
    for path in settings.configfiles:
        relative = os.path.relpath(path)
        files.append(str(path) if relative.startswith("..") else relative)
    return {"configfiles": files, "config": without_compare(settings.config)}


def interpreter(wildcards, input):
    """The Python running Snakemake (it has `pipeline`: this file imports it), which jobs run
    as `{params.python:q} -m pipeline`; `python` on PATH may be another one when the venv's
    snakemake is called by path. In a cluster job it is the interpreter on the node.

    The `input` argument, unused, makes Snakemake count the value as derived from the inputs
    and leave it out of its params rerun trigger: the same venv at another path (or spelled
    python3) reruns nothing, where `python=sys.executable` would rerun every job.
    """
    return sys.executable


def heavy_threads():
    """Timing and training jobs take every core of a local run, so nothing shares the machine
    meanwhile. On a cluster, cluster_cpus() sizes them instead: Snakemake caps threads at
    --cores (1 by workflow/profiles/default, which applies under --profile too), and this runs
    while the Snakefile is parsed, before Snakemake knows its executor."""
    try:
        return max(1, workflow.cores)
    except WorkflowError:  # no --cores given (a dry run, say)
        return 1


def cluster_cpus():
    """The CPUs a compute job asks a cluster for (cluster.threads), as the SLURM plugin's
    cpus_per_task resource: sbatch and the job's srun take it before threads, no --cores caps
    it, and a local run ignores it."""
    return config["cluster"]["threads"]


def env_report():
    return runs.read_env(checkpoints.check_env.get().output[0])


def measured_choices(backend):
    """The precision precision=measured chose per model on a backend (choose_precision checkpoint)."""
    path = checkpoints.choose_precision.get(backend=backend).output[0]
    return {
        model: choice.precision for model, choice in measured.read_choices(path).items()
    }


# What the config asks of the machine check_env described (an absent backend, a precision it
# does not train in) is found in these helpers of input functions: stops_the_workflow says it
# as one paragraph, where Snakemake would print a traceback.
@stops_the_workflow
def training_runs():
    return runs.training_runs(config, env_report(), measured_choices)


@stops_the_workflow
def bench_matrix():
    return runs.bench_matrix(config, env_report())


@stops_the_workflow
def measured_backends():
    return runs.measured_backends(config, env_report())


@stops_the_workflow  # a run the config does not ask for, named as a target
def training_run(wildcards):
    return runs.find_run(training_runs(), wildcards.run)


def gpu_request(device_text):
    """One GPU for a cuda job; no GPU resource at all otherwise (sbatch rejects GPU requests
    on nodes without GPUs)."""
    return 1 if device_text.startswith("cuda") else None


def gpu_model(device_text):
    return config["cluster"]["gpu_model"] if device_text.startswith("cuda") else None


def env_check_device():
    """check_env runs where the config's GPU jobs will run, so env.json describes that node."""
    listed = config["bench"]["backends"]
    wants_cuda = config["device"].startswith("cuda") or (
        listed != "available" and "cuda" in listed
    )
    return "cuda" if wants_cuda else "cpu"


def bench_outputs():
    """bench_backend's files: every precision x mode of one backend, which one job times
    (the file names every reader knows, one per combination)."""
    return [
        report_file(
            f"results/bench/{{backend}}-{precision}-{mode}.json",
            caption="../report/bench.rst",
            category="Benchmarks",
            labels={"backend": "{backend}", "precision": precision, "mode": mode},
        )
        for precision in config["bench"]["precisions"]
        for mode in config["bench"]["modes"]
    ]


def bench_files(wildcards):
    return [
        f"results/bench/{backend}-{precision}-{mode}.json"
        for backend, precision, mode in bench_matrix()
    ]


def choice_inputs(wildcards):
    """The training benchmarks of one backend: what precision=measured chooses from."""
    return [
        f"results/bench/{backend}-{precision}-{mode}.json"
        for backend, precision, mode in bench_matrix()
        if backend == wildcards.backend and mode == "train"
    ]


def precision_choice(wildcards):
    """A measured run's choice file (its training depends on it); none for other runs."""
    run = training_run(wildcards)
    if not run.measured:
        return []
    return [CHOICE_JSON.format(backend=run.device.partition(":")[0])]


def choice_files(wildcards):
    """The choose_precision outputs the config's runs read, as plain inputs of what aggregates
    the runs (run_files gives no runs until they exist). Through the checkpoint alone a missing
    choice is not made when the file that reads it exists (Snakemake 9, PR #4124), so
    `--config precision=measured` after a plain run would leave the report as it was; as a plain
    input it is made, and Snakemake evaluates run_files again once it is there."""
    return [CHOICE_JSON.format(backend=backend) for backend in measured_backends()]


def run_files(pattern):
    """An input function giving `pattern` for every training run the config asks for."""

    def files(wildcards):
        try:
            return [pattern.format(run=run.name) for run in training_runs()]
        except IncompleteCheckpointException as error:
            # a choice on disk is read through the checkpoint as usual; a missing one is
            # made first through choice_files, and this is evaluated again once it is there
            if error.rule.name != "choose_precision" or os.path.exists(
                error.targetfile
            ):
                raise
            return []

    return files


def compared_summaries(wildcards):
    """The summaries results/compare.html sets side by side (the config's compare list)."""
    if not config["compare"]:
        raise WorkflowError(
            "results/compare.html compares the summary.json files of the config's compare list, "
            "and it is empty: set it, for example --config 'compare=[runs/a100/summary.json, "
            "results/summary.json]' (results/summary.json is this run's own)."
        )
    return config["compare"]


def synthetic_settings(without=()):
    """The config's data.synthetic keys, less `without`: what a data rule's output depends on."""
    return {
        key: value
        for key, value in config["data"]["synthetic"].items()
        if key not in without
    }


def data_inputs(splits):
    """An input function: the files defining `splits` (generated, or the user's COCO
    annotation files or VOC listings, as pipeline.data finds them; test only where it exists).
    """

    @stops_the_workflow  # a data set that names its splits wrongly
    def files(wildcards):
        if config["data"]["format"] == "synthetic":
            generated = {
                "train": rules.prepare_data.output.train,
                "val": rules.prepare_data.output.val,
            }
            if has_test_split(config):
                generated["test"] = rules.prepare_test_data.output.test
            return [generated[split] for split in splits if split in generated]
        return [str(path) for path in split_files(config, splits)]

    return files


def class_list_inputs(wildcards):
    """What the benchmarks read to know training's class count: the user's training and
    validation splits (pipeline.data.class_count: the categories neither has an object of are
    left out); nothing for the synthetic set, whose classes are in the config.
    Ancient: read, never a reason to rerun. An edited box moves no timing, and a class added
    changes the head by a channel, while the benchmarks take minutes; training and evaluation
    take the same files as inputs that do rerun them."""
    if config["data"]["format"] == "synthetic" or config["data"]["classes"]:
        return []
    return [ancient(str(path)) for path in split_files(config, ("train", "val"))]


def train_settings(wildcards):
    """What the run's result depends on (pipeline.setting_groups.result_settings, which resume checks
    too), with the run's own precision and swept values: a change reruns training."""
    run_config = runs.run_config(config, training_run(wildcards))
    return runs.flatten(setting_groups.result_settings(run_config))


def train_other_settings(wildcards, threads):
    """The rest of what training reads (pipeline.setting_groups.other_training_settings): how
    fast data load, validation's batch size, the test split while training carves it. A
    params function of `threads` is a derived param to Snakemake (snakemake#3154), which
    leaves it out of the params rerun trigger: changing one of these reruns nothing."""
    return runs.flatten(setting_groups.other_training_settings(config))


def bench_numerics_settings(wildcards, threads):
    """The training keys the benchmark's numerics check reads (runs.bench_numerics_settings):
    without them it would train at the defaults, not at the user's --configfile. Derived (a
    function of `threads`, see train_other_settings): a new learning rate reruns training, not
    the benchmarks."""
    return runs.flatten(runs.bench_numerics_settings(config))


def bench_data_settings(wildcards, threads):
    """The data keys the benchmark reads that change nothing it times (runs.bench_data_settings):
    derived (see train_other_settings), so that a new data.val_fraction, say, reruns training,
    not the benchmarks."""
    return runs.flatten(runs.bench_data_settings(config))


def loading_settings(wildcards, threads):
    """How fast data load (pipeline.setting_groups.loading_settings), for the evaluation: the
    checkpoint's config keeps the values training ran with, and a change since (data.cache:
    false after caching ran out of memory) must reach it. Derived (a function of `threads`,
    see train_other_settings): changing one reruns nothing."""
    return runs.flatten(setting_groups.loading_settings(config))


def precision_choice_option(wildcards, input):
    return ["--precision-choice", input.choice[0]] if input.choice else []


def run_device(wildcards):
    return runs.parse_run(wildcards.run).device


def predict_items():
    """The configured predict.images as a list (one item may be given alone)."""
    images = config["predict"]["images"]
    return [images] if isinstance(images, str) else list(images or [])


def predict_images(wildcards):
    """The image files predict.images names: a changed folder reruns prediction."""
    if not predict_items():
        raise WorkflowError(
            "The predict target needs images: set predict.images to image files, folders or "
            "glob patterns, e.g. --config 'predict={images: [photos/]}'."
        )
    return [str(path) for path in find_images(predict_items())]


def predict_batch_size(wildcards, threads):
    """eval.batch_size as the config has it now: the checkpoint's is training's, and a smaller
    one set since (a GPU out of memory) must reach prediction. Derived (see loading_settings):
    changing it reruns nothing."""
    return config["eval"]["batch_size"]


def predict_num_workers(wildcards, threads):
    """data.num_workers as the config has it now: the checkpoint's is training's, and a 0 set
    since (a container whose workers cannot start) must reach prediction. Derived (see
    loading_settings): changing it reruns nothing."""
    return config["data"]["num_workers"]


def predict_options():
    settings = config["predict"]
    threshold = settings["score_threshold"]
    options = [] if threshold is None else ["--score-threshold", str(threshold)]
    return options + (["--draw"] if settings["draw"] else [])
