rule report:
    input:
        env=ENV_JSON,
        bench=bench_files,
        train=run_files("results/train/{run}/train_summary.json"),
        evaluation=run_files("results/eval/{run}.json"),
        profile=run_files("results/profile/{run}/profile.json"),
        choices=choice_files,
        code=code("commands/report.py", *package_files("report")),
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
        config=json.dumps(config, sort_keys=True),
        invocation=json.dumps(invocation(), sort_keys=True),
    shell:
        "{params.python:q} -m pipeline --log {log} report --results {params.results:q} --config-json {params.config:q}"
        " --invocation-json {params.invocation:q} --out {output:q}"
