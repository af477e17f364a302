# Only the built-in data set is generated: with data.format coco or voc, missing annotation
# files must stop the run, never be filled with synthetic data. The test split has a rule of
# its own: every sample is seeded by its split and index, so a larger test split (to narrow
# the intervals the evaluation reports) regenerates it alone and reruns evaluation, not training.
if config["data"]["format"] == "synthetic":

    rule prepare_data:
        input:
            code=command_sources("prepare-data"),
        output:
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
            settings=runs.flatten(
                {"data": {"synthetic": synthetic_settings(without=("num_test",))}}
            ),
        shell:
            "{params.python:q} -m pipeline --log {log} prepare-data --splits train val --out {params.root:q} {params.settings:q}"

    if has_test_split(config):

        rule prepare_test_data:
            input:
                code=command_sources("prepare-data"),
            output:
                test=f"{DATA_ROOT}/instances_test.json",
            log:
                "logs/prepare_test_data.log",
            benchmark:
                "results/job_stats/prepare_test_data.tsv"
            conda:
                "../envs/pipeline.yaml"
            resources:
                mem_mb=2000,
                runtime=15,
            params:
                python=interpreter,
                root=lambda wildcards, output: os.path.dirname(output.test),
                settings=runs.flatten({"data": {"synthetic": synthetic_settings()}}),
            shell:
                "{params.python:q} -m pipeline --log {log} prepare-data --splits test --out {params.root:q} {params.settings:q}"
