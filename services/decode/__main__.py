"""``python -m services.decode``: a decode instance."""

from services.decode.service import DecodeService
from shared.service import main

if __name__ == "__main__":
    main(DecodeService)
