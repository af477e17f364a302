rule train_run:
    input:
        data=data_inputs(("train", "val")),
        env=ENV_JSON,
        choice=precision_choice,
        code=command_sources("train"),
    output:
        summary=report(
            "results/train/{run}/train_summary.json",
            caption="../report/training.rst",
            category="Training",
            labels={"run": "{run}"},
        ),
        checkpoint="results/train/{run}/best.pth",
    log:
        "logs/train/{run}.log",
    benchmark:
        "results/job_stats/train/{run}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: heavy_threads()
    resources:
        cpus_per_task=cluster_cpus(),
        mem_mb=8000,
        runtime=240,
        gpu=lambda wildcards: gpu_request(wildcards.run),
        gpu_model=lambda wildcards: gpu_model(wildcards.run),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
        device=run_device,
        run_dir="results/train/{run}",
        choice=precision_choice_option,
        settings=train_settings,
        other=train_other_settings,
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} train --resume-if-possible --device {params.device}"
        " --out {params.run_dir:q} {params.choice:q} {params.settings:q} {params.other:q}"


rule train:
    input:
        run_files("results/train/{run}/train_summary.json"),
        choice_files,
