"""``python -m halfmoon.services.transfer``: a transfer node of the KVCache pool."""

from halfmoon.services.transfer.service import TransferService
from halfmoon.service import main

if __name__ == "__main__":
    main(TransferService)
