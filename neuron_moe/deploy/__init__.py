"""Running the serving image on the engines inf2 users scale out on: Kubernetes manifests derived from
the plan (`k8s.py`, `neuron-moe deploy k8s`), and SageMaker's hosting contract (`sagemaker.py`, run by
docker/entrypoint.sh for `docker run IMAGE serve`). docs/deploy.md says what each file does and what
has run: neither has run on a cluster or an endpoint."""
