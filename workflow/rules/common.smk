# Shared helpers: config validation, the job matrix and input functions of every stage.
import json
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from pipeline import config as pipeline_config
from pipeline import runs
from pipeline.data import annotation_file

config.update(pipeline_config.normalize(config))


validate(config, schema="../schemas/config.schema.yaml")


pipeline_config.check_relations(config, "the workflow config")


wildcard_constraints:
    backend="cpu|cuda|mps",
    precision="fp32|fp16|bf16",
    mode="train|infer",
    run=r"(cpu|mps|cuda\d*)-(fp32|fp16|bf16)(\+[^/]+)?",


ENV_JSON = "results/env.json"
DATA_ROOT = config["data"]["root"]


def code(*modules):
    """Source files of a stage as inputs: editing one reruns that stage (mtime trigger)."""
    return [f"src/pipeline/{module}" for module in modules]


def heavy_threads():
    """Timing and training jobs take every core of a local run, so nothing shares the machine
    meanwhile; through a cluster executor they ask for cluster.threads CPUs."""
    if workflow.local_exec:
        try:
            return max(1, workflow.cores)
        except WorkflowError:  # no --cores given (a dry run, say)
            return 1
    return config["cluster"]["threads"]


def env_report():
    return runs.read_env(checkpoints.check_env.get().output[0])


def training_runs():
    return runs.training_runs(config, env_report())


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


def bench_files(wildcards):
    return [
        f"results/bench/{backend}-{precision}-{mode}.json"
        for backend, precision, mode in runs.bench_matrix(config, env_report())
    ]


def run_files(pattern):
    """An input function giving `pattern` for every training run the config asks for."""

    def files(wildcards):
        return [pattern.format(run=run.name) for run in training_runs()]

    return files


def data_inputs(wildcards):
    """The files that must exist before training: generated, or the user's annotations."""
    data = config["data"]
    if data["format"] == "synthetic":
        return rules.prepare_data.output
    if data["format"] == "voc":
        return [
            f"{DATA_ROOT}/ImageSets/Main/{data['train_split']}.txt",
            f"{DATA_ROOT}/ImageSets/Main/{data['val_split']}.txt",
        ]
    return [str(annotation_file(config, split)) for split in ("train", "val")]


def train_settings(wildcards):
    """What the run's result depends on (pipeline.config.result_settings, which resume checks
    too), with the run's own precision and swept values: a change reruns training."""
    run_config = runs.run_config(config, runs.parse_run(wildcards.run))
    return runs.flatten(pipeline_config.result_settings(run_config))


def train_speed_settings(wildcards, threads):
    """The rest of what training reads: how fast data load, validation's batch size. A
    params function of `threads` is a derived param to Snakemake (snakemake#3154), which
    leaves it out of the params rerun trigger: changing one of these reruns nothing."""
    return runs.flatten(pipeline_config.speed_settings(config))


def run_device(wildcards):
    return runs.parse_run(wildcards.run).device
