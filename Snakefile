# Training-throughput probes: where did a fine-tuning step's time go?
# Chain: mask -> padding -> bucket_sweep -> profile, replay -> realize, data_parallel
# (world_size > 1) -> report (the default target).


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/assets.smk"
include: "workflow/rules/mask.smk"
include: "workflow/rules/padding.smk"
include: "workflow/rules/bucket.smk"
include: "workflow/rules/memory.smk"
include: "workflow/rules/profile.smk"
include: "workflow/rules/replay.smk"
include: "workflow/rules/realize.smk"
include: "workflow/rules/data_parallel.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output.markdown,
