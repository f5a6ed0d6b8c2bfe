"""``python -m halfmoon.services.conductor``: the global scheduler."""

from halfmoon.services.conductor.service import ConductorService
from halfmoon.service import main

if __name__ == "__main__":
    main(ConductorService)
