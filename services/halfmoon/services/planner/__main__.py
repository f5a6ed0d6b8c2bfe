"""``python -m halfmoon.services.planner``: sizes the engine pools of a compose deployment (docs/PLANNER.md)."""

import sys

from halfmoon.runtime import load_config
from halfmoon.services.planner.service import PlannerServiceConfig, serve

if __name__ == "__main__":
    sys.exit(serve(load_config(PlannerServiceConfig, prog="python -m halfmoon.services.planner")))
