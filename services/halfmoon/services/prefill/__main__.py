"""``python -m halfmoon.services.prefill``: a prefill instance."""

from halfmoon.runtime import main
from halfmoon.services.prefill.service import PrefillService

if __name__ == "__main__":
    main(PrefillService)
