"""``python -m halfmoon.services.decode``: a decode instance."""

from halfmoon.services.decode.service import DecodeService
from halfmoon.service import main

if __name__ == "__main__":
    main(DecodeService)
