# Data parallel (issues 22, 45): real DDP / FSDP2 steps under torchrun, W = training.world_size
# ranks, one torchrun per data_parallel.sharding; each rank runs the user's trainer (its own
# distributed dataloader's micro-batches) where trainer.factory / trainer.command is set, else the
# harness on its shard of the plans (DDP). Only when world_size > 1; the
# report then reads its outputs (probes.contracts.optional_report_inputs), else says
# "world_size 1". One job holds all W ranks: gpu=W on a GPU run (none when profile.device is
# cpu: gloo ranks on CPU cores), threads W (one core per rank, the plugin's --cpus-per-task), one SLURM task running
# torchrun --nproc_per_node W. The workflow profile's `resources: gpu=1` caps a job's gpu: a W-GPU
# run passes --resources gpu=W (last on the command line).
if stage_enabled("data_parallel", config):

    rule data_parallel:
        input:
            **stage_inputs("data_parallel", config),
        output:
            steps=out("data_parallel", "steps"),
            summary=out("data_parallel", "summary"),
        log:
            "logs/data_parallel.log",
        benchmark:
            "benchmarks/data_parallel.tsv"
        conda:
            "../envs/probes.yaml"
        threads: dp_ranks(config)
        resources:
            # no `tasks`: on a GPU job the SLURM plugin turns it into --ntasks-per-gpu (W srun
            # copies of the job); sbatch's default of one task is what torchrun needs
            gpu=dp_gpus(config),
            timing=1,
        params:
            # the config sections the stage reads: a change reruns it
            trainer=config["trainer"],
            data_parallel=config["data_parallel"],
            profile=config["profile"],
            training=config["training"],
        script:
            "../../scripts/run_data_parallel.py"
