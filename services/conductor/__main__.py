"""``python -m services.conductor``: the global scheduler."""

from services.conductor.service import ConductorService
from shared.service import main

if __name__ == "__main__":
    main(ConductorService)
