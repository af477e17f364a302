checkpoint check_env:
    input:
        code=command_sources("check-env"),
    output:
        ENV_JSON,
    log:
        "logs/check_env.log",
    benchmark:
        "results/job_stats/check_env.tsv"
    priority: 100
    conda:
        "../envs/pipeline.yaml"
    # the CPUs compute jobs get: env.json's torch threads are the report's and compare's
    resources:
        cpus_per_task=cluster_cpus(),
        mem_mb=2000,
        runtime=10,
        gpu=gpu_request(env_check_device()),
        gpu_model=gpu_model(env_check_device()),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} check-env --out {output}"
