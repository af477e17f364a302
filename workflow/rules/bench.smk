rule bench_backend:
    input:
        env=ENV_JSON,
        classes=class_list_inputs,
        code=command_sources("bench"),
    output:
        bench_outputs(),
    log:
        "logs/bench/{backend}.log",
    benchmark:
        "results/job_stats/bench/{backend}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: heavy_threads()
    resources:
        bench_slot=1,
        cpus_per_task=cluster_cpus(),
        mem_mb=4000,
        runtime=30,
        gpu=lambda wildcards: gpu_request(wildcards.backend),
        gpu_model=lambda wildcards: gpu_model(wildcards.backend),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
        precisions=",".join(config["bench"]["precisions"]),
        modes=",".join(config["bench"]["modes"]),
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
        settings=runs.flatten(runs.bench_settings(config)),
        numerics=bench_numerics_settings,
        data=bench_data_settings,
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} bench --device {wildcards.backend}"
        " --precision {params.precisions} --mode {params.modes} --out-dir {params.out_dir:q} {params.settings:q} {params.numerics:q}"
        " {params.data:q}"


checkpoint choose_precision:
    input:
        bench=choice_inputs,
        env=ENV_JSON,
        code=command_sources("choose-precision"),
    output:
        CHOICE_JSON,
    log:
        "logs/choice/{backend}.log",
    benchmark:
        "results/job_stats/choice/{backend}.tsv"
    conda:
        "../envs/pipeline.yaml"
    # no GPU: it reads the benchmark files and env.json (which says what the backend refuses)
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        python=interpreter,
        bench_dir="results/bench",
        settings=runs.flatten({"bench": {"models": runs.benchmarked_models(config)}}),
    shell:
        "{params.python:q} -m pipeline --log {log} choose-precision --device {wildcards.backend} --bench {params.bench_dir:q}"
        " --env {input.env:q} --out {output:q} {params.settings:q}"


rule bench:
    input:
        bench_files,
