rule summarize:
    input:
        env=ENV_JSON,
        bench=bench_files,
        train=run_files("results/train/{run}/train_summary.json"),
        evaluation=run_files("results/eval/{run}.json"),
        choices=choice_files,
        code=command_sources("summarize"),
    output:
        "results/summary.json",
    log:
        "logs/summarize.log",
    benchmark:
        "results/job_stats/summarize.tsv"
    conda:
        "../envs/pipeline.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        python=interpreter,
        results=lambda wildcards, output: os.path.dirname(output[0]),
        config=results_config(),
    shell:
        "{params.python:q} -m pipeline --log {log} summarize --results {params.results:q} --config-json {params.config:q}"
        " --out {output:q}"


rule report:
    input:
        summary=rules.summarize.output[0],
        env=ENV_JSON,
        bench=bench_files,
        train=run_files("results/train/{run}/train_summary.json"),
        evaluation=run_files("results/eval/{run}.json"),
        profile=run_files("results/profile/{run}/profile.json"),
        choices=choice_files,
        code=command_sources("report"),
    output:
        report(
            "results/report.html",
            caption="../report/report.rst",
            category="Comparison report",
        ),
    log:
        "logs/report.log",
    benchmark:
        "results/job_stats/report.tsv"
    conda:
        "../envs/pipeline.yaml"
    resources:
        mem_mb=2000,
        runtime=15,
    params:
        python=interpreter,
        results=lambda wildcards, output: os.path.dirname(output[0]),
        config=results_config(),
        invocation=json.dumps(invocation(), sort_keys=True),
    shell:
        "{params.python:q} -m pipeline --log {log} report --results {params.results:q} --summary {input.summary:q}"
        " --config-json {params.config:q} --invocation-json {params.invocation:q} --out {output:q}"


rule compare:
    input:
        summaries=compared_summaries,
        code=command_sources("compare"),
    output:
        report(
            "results/compare.html",
            caption="../report/compare.rst",
            category="Comparison report",
        ),
    log:
        "logs/compare.log",
    conda:
        "../envs/pipeline.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        python=interpreter,
    shell:
        "{params.python:q} -m pipeline --log {log} compare {input.summaries:q} --out {output:q}"
