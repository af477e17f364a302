rule predict_run:
    input:
        checkpoint="results/train/{run}/best.pth",
        images=predict_images,
        code=command_sources("predict"),
    output:
        detections="results/predict/{run}/detections.json",
        index="results/predict/{run}/images.json",
    log:
        "logs/predict/{run}.log",
    benchmark:
        "results/job_stats/predict/{run}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: heavy_threads()
    resources:
        cpus_per_task=cluster_cpus(),
        mem_mb=4000,
        runtime=60,
        gpu=lambda wildcards: gpu_request(wildcards.run),
        gpu_model=lambda wildcards: gpu_model(wildcards.run),
    params:
        python=interpreter,
        cpu_threads=config["cpu_threads"],
        device=run_device,
        out="results/predict/{run}",
        images=predict_items(),
        options=predict_options(),
        batch_size=predict_batch_size,
        num_workers=predict_num_workers,
    shell:
        "{params.python:q} -m pipeline --log {log} --cpu-threads {params.cpu_threads} predict --checkpoint {input.checkpoint:q} --device {params.device}"
        " --out {params.out:q} --batch-size {params.batch_size} --num-workers {params.num_workers} {params.options:q} {params.images:q}"


rule predict:
    input:
        run_files("results/predict/{run}/images.json"),
        choice_files,
