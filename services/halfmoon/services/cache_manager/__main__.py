"""``python -m halfmoon.services.cache_manager``: the KVCache pool's metadata master."""

from halfmoon.runtime import main
from halfmoon.services.cache_manager.service import CacheManagerService

if __name__ == "__main__":
    main(CacheManagerService)
