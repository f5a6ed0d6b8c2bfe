"""``python -m services.cache_manager``: the KVCache pool's metadata master."""

from services.cache_manager.service import CacheManagerService
from shared.service import main

if __name__ == "__main__":
    main(CacheManagerService)
