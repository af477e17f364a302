rule bench_one:
    input:
        env=ENV_JSON,
        code=code(
            "bench.py",
            "timing.py",
            "device.py",
            "models/centernet.py",
            "models/loss.py",
        ),
    output:
        report(
            "results/bench/{backend}-{precision}-{mode}.json",
            caption="../report/bench.rst",
            category="Benchmarks",
            labels={
                "backend": "{backend}",
                "precision": "{precision}",
                "mode": "{mode}",
            },
        ),
    log:
        "logs/bench/{backend}-{precision}-{mode}.log",
    benchmark:
        "results/job_stats/bench/{backend}-{precision}-{mode}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: heavy_threads()
    resources:
        bench_slot=1,
        mem_mb=4000,
        runtime=30,
        gpu=lambda wildcards: gpu_request(wildcards.backend),
        gpu_model=lambda wildcards: gpu_model(wildcards.backend),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
        models=",".join(config["bench"]["models"]),
        batch_size=config["bench"]["batch_size"],
        image_size=config["bench"]["image_size"],
        warmup=config["bench"]["warmup_steps"],
        steps=config["bench"]["steps"],
        budget=config["bench"]["time_budget_s"],
        flags=[
            flag
            for flag, on in (
                ("--channels-last", config["bench"]["channels_last"]),
                ("--compile", config["bench"]["compile"]),
            )
            if on
        ],
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} bench --device {wildcards.backend}"
        " --precision {wildcards.precision} --mode {wildcards.mode} --model {params.models}"
        " --batch-size {params.batch_size} --image-size {params.image_size}"
        " --warmup {params.warmup} --steps {params.steps} --time-budget {params.budget}"
        " {params.flags} --out {output}"


rule bench:
    input:
        bench_files,
