"""``python -m halfmoon.services.transfer``: a transfer node of the KVCache pool."""

from halfmoon.runtime import main
from halfmoon.services.transfer.service import TransferService

if __name__ == "__main__":
    main(TransferService)
