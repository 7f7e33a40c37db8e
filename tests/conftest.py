import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# The default run draws the same examples every time, so a suite that passed once keeps
# passing; `--hypothesis-profile=explore` draws fresh examples to hunt for
# new counterexamples, each of which then becomes an explicit test.
settings.register_profile("default", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("default")
