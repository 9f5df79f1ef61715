"""Profile: step-time scaling fit, padding penalty, CE wall clock, kernel table, through the
user's harness on an idle GPU (CPU fallback with small lengths, labelled as such).

Run by `snakemake profile`, or standalone (no Snakemake needed), e.g. on a GPU node:
    python scripts/run_profile.py --results results --set profile.device=cuda \\
        --set profile.cuda.lengths=[2048,4096,8192]
"""

from probes.step.threads import steady_allocator

steady_allocator()  # before torch: glibc reads its settings at start

from probes.profile import stage as profile_stage  # noqa: E402
from probes.stage import main  # noqa: E402

main("profile", profile_stage.run, __doc__, globals())
