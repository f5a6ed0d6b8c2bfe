"""``python -m halfmoon.services.gateway``: the OpenAI-compatible HTTP front door."""

from halfmoon.runtime import main
from halfmoon.services.gateway.service import GatewayService

if __name__ == "__main__":
    main(GatewayService)
