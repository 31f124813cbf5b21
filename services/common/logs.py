"""One logging setup for every service."""

import logging


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
