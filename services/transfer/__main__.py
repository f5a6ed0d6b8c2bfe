"""``python -m services.transfer``: a transfer node of the KVCache pool."""

from services.transfer.service import TransferService
from shared.service import main

if __name__ == "__main__":
    main(TransferService)
