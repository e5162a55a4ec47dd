"""Names of the evaluation tasks (cheap to import: the CLI builds its parser from them)."""

from ..synth_data.probes import PROBE_TASKS

# The probe tasks, plus "niah" (= niah_single), "ruler" (the six RULER-lite tasks) and perplexity.
EVAL_TASKS = PROBE_TASKS + ("niah", "ruler", "perplexity")
