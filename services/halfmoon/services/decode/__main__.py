"""``python -m halfmoon.services.decode``: a decode instance."""

from halfmoon.runtime import main
from halfmoon.services.decode.service import DecodeService

if __name__ == "__main__":
    main(DecodeService)
