"""``python -m halfmoon.services.prefill``: a prefill instance."""

from halfmoon.services.prefill.service import PrefillService
from halfmoon.service import main

if __name__ == "__main__":
    main(PrefillService)
