"""Running it: flatwire up, docker-compose.yml, the Kubernetes manifests, Hub models, authentication between
the services and of clients."""
