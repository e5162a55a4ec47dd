"""Names of the evaluation tasks (cheap to import: the CLI builds its parser from them)."""

from ..synth_data.probes import TASKS as PROBE_TASKS

# The probe tasks, plus "niah" (= niah_single), "ruler" (the six RULER-lite tasks) and perplexity.
TASKS = PROBE_TASKS + ("niah", "ruler", "perplexity")
