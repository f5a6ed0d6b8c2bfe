"""``python -m halfmoon.services.aggregated``: an aggregated instance (prefill and decode in one engine)."""

from halfmoon.runtime import main
from halfmoon.services.aggregated.service import AggregatedService

if __name__ == "__main__":
    main(AggregatedService)
