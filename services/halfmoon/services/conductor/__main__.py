"""``python -m halfmoon.services.conductor``: the global scheduler."""

from halfmoon.runtime import main
from halfmoon.services.conductor.service import ConductorService

if __name__ == "__main__":
    main(ConductorService)
