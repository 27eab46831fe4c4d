"""`python -m regen.train ...` and `torchrun --nproc_per_node N -m regen.train -- ...`: the trainer's command line."""
import sys

from regen.train.loop import script_main

sys.exit(script_main())
