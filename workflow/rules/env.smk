checkpoint check_env:
    input:
        code("environment.py", "device.py"),
    output:
        ENV_JSON,
    log:
        "logs/check_env.log",
    benchmark:
        "results/job_stats/check_env.tsv"
    priority: 100
    conda:
        "../envs/pipeline.yaml"
    resources:
        gpu=needs_gpu(config["device"]),
    params:
        cpu_threads=config["cpu_threads"],
    shell:
        "python -m pipeline --log {log} --cpu-threads {params.cpu_threads} check-env --output {output}"
