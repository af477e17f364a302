# Only the built-in data set is generated: with data.format coco or voc, missing annotation
# files must stop the run, never be filled with synthetic data.
if config["data"]["format"] == "synthetic":

    rule prepare_data:
        input:
            code("data/synthetic.py"),
        output:
            **synthetic_test_output(),
            train=f"{DATA_ROOT}/instances_train.json",
            val=f"{DATA_ROOT}/instances_val.json",
        log:
            "logs/prepare_data.log",
        benchmark:
            "results/job_stats/prepare_data.tsv"
        conda:
            "../envs/pipeline.yaml"
        resources:
            mem_mb=2000,
            runtime=15,
        params:
            python=interpreter,
            root=lambda wildcards, output: os.path.dirname(output.train),
            settings=runs.flatten({"data": {"synthetic": config["data"]["synthetic"]}}),
        shell:
            "{params.python:q} -m pipeline --log {log} prepare-data --out {params.root:q} {params.settings:q}"
