rule evaluate_run:
    input:
        checkpoint="results/train/{run}/best.pth",
        data=data_inputs(("val", "test")),
        code=command_sources("evaluate"),
    output:
        metrics=report(
            "results/eval/{run}.json",
            caption="../report/evaluation.rst",
            category="Evaluation",
            labels={"run": "{run}"},
        ),
        predictions="results/eval/{run}_predictions.json",
    log:
        "logs/evaluate/{run}.log",
    benchmark:
        "results/job_stats/evaluate/{run}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: heavy_threads()
    resources:
        cpus_per_task=cluster_cpus(),
        mem_mb=4000,
        runtime=30,
        gpu=lambda wildcards: gpu_request(wildcards.run),
        gpu_model=lambda wildcards: gpu_model(wildcards.run),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
        device=run_device,
        settings=runs.flatten(setting_groups.evaluation_settings(config)),
        loading=loading_settings,
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} evaluate --checkpoint {input.checkpoint:q} --device {params.device}"
        " --out {output.metrics:q} --predictions {output.predictions:q} {params.settings:q} {params.loading:q}"


rule evaluate:
    input:
        run_files("results/eval/{run}.json"),
        choice_files,
