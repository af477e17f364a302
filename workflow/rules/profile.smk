rule profile_run:
    input:
        checkpoint="results/train/{run}/best.pth",
        code=command_sources("profile"),
    output:
        profile="results/profile/{run}/profile.json",
        operators="results/profile/{run}/operators.json",
        trace="results/profile/{run}/trace.json",
    log:
        "logs/profile/{run}.log",
    benchmark:
        "results/job_stats/profile/{run}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: heavy_threads()
    resources:
        bench_slot=1,
        cpus_per_task=cluster_cpus(),
        mem_mb=4000,
        runtime=30,
        gpu=lambda wildcards: gpu_request(wildcards.run),
        gpu_model=lambda wildcards: gpu_model(wildcards.run),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
        device=run_device,
        out="results/profile/{run}",
        batch_sizes=",".join(str(size) for size in config["profile"]["batch_sizes"]),
        warmup=config["profile"]["warmup"],
        repeats=config["profile"]["repeats"],
        budget=config["profile"]["time_budget_s"],
        trace_steps=config["profile"]["trace_steps"],
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} profile --checkpoint {input.checkpoint:q} --device {params.device}"
        " --batch-sizes {params.batch_sizes} --warmup {params.warmup} --repeats {params.repeats}"
        " --time-budget {params.budget} --trace-steps {params.trace_steps} --out {params.out:q}"


rule profile:
    input:
        run_files("results/profile/{run}/profile.json"),
        choice_files,
