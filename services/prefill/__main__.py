"""``python -m services.prefill``: a prefill instance."""

from services.prefill.service import PrefillService
from shared.service import main

if __name__ == "__main__":
    main(PrefillService)
