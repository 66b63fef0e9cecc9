"""Rotation algebra (SPEC §1): Hadamard, bit-reversal permutation, composition, checks.

Column convention: a row vector x is rotated as x @ R.
"""

from __future__ import annotations

import math

import torch

from ..errors import ArtifactError, OscarError, UnsupportedModelError

ORTHOGONALITY_TOLERANCE = 1e-4  # ||RᵀR - I||_max for a float32-stored rotation


def check_power_of_two(head_dim: int) -> None:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise UnsupportedModelError(
            f"head_dim={head_dim} is not a power of two: the Walsh-Hadamard and bit-reversal "
            "factors of OSCAR need one. Use a model with head_dim 64/128/256, or INT2 without a rotation "
            "(method 'naive'; `calibrate --method identity`), which needs none."
        )


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Walsh-Hadamard matrix of size n (n a power of two), Sylvester order."""
    check_power_of_two(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)


def bit_reverse_indices(n: int) -> torch.Tensor:
    """i -> i with its log2(n) bits reversed, for i in 0..n-1."""
    check_power_of_two(n)
    bits = n.bit_length() - 1
    return torch.tensor([int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(n)])


def bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """P_br: the i-th largest eigen-direction goes to output position bitrev(i).

    Returns a d x d permutation matrix P (float64) such that (x @ P)[bitrev(i)] = x[order[i]],
    where order sorts the eigenvalues descending. Each group of consecutive channels then
    holds one channel from every importance level.
    """
    d = eigenvalues.numel()
    order = torch.argsort(eigenvalues.double(), descending=True, stable=True)
    source = torch.empty(d, dtype=torch.long)
    source[bit_reverse_indices(d)] = order
    return torch.eye(d, dtype=torch.float64)[:, source]


def sorted_eigh(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetrise and eigendecompose in float64; eigenvalues descending, vectors as columns."""
    cov = cov.double()
    cov = (cov + cov.T) / 2
    values, vectors = torch.linalg.eigh(cov)
    order = torch.argsort(values, descending=True, stable=True)
    return values[order], vectors[:, order]


def compose_rotation(eigenvectors: torch.Tensor, eigenvalues: torch.Tensor) -> torch.Tensor:
    """R = U · H · P_br (float64), the OSCAR composition."""
    d = eigenvectors.shape[0]
    return eigenvectors.double() @ hadamard(d) @ bit_reversal_permutation(eigenvalues)


def orthogonality_error(r: torch.Tensor) -> float:
    """max |RᵀR - I| computed in float64."""
    r = r.double()
    return (r.T @ r - torch.eye(r.shape[0], dtype=torch.float64)).abs().max().item()


def check_orthogonal(r: torch.Tensor, name: str) -> None:
    """Raise ArtifactError unless r ([d, d], or [H, d, d]: each of them) is orthogonal."""
    if r.dim() == 3:
        for head, matrix in enumerate(r):
            check_orthogonal(matrix, f"{name}[{head}]")
        return
    err = orthogonality_error(r)
    if not err <= ORTHOGONALITY_TOLERANCE:
        raise ArtifactError(
            f"{name} is not orthogonal (max |RᵀR - I| = {err:.2e} > {ORTHOGONALITY_TOLERANCE:g}); "
            "the artifact is corrupt: re-run `oscarkv calibrate`."
        )


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor, head_axis: int) -> torch.Tensor:
    """x @ R for every head of x, where R is one [d, d] rotation for all heads or one per KV head.

    x: a tensor whose last axis is the head dimension d and whose axis `head_axis` holds H heads
    (query heads, or KV heads); rotation: [d, d], or [Hkv, d, d] with H a multiple of Hkv, head i
    taking rotation[i // (H // Hkv)] (the KV head of its GQA group). Computed in x's dtype.
    """
    if rotation.dim() == 2:
        return x @ rotation
    kv_heads = rotation.shape[0]
    moved = x.movedim(head_axis, -3)  # [..., H, n, d]
    heads = moved.shape[-3]
    if heads % kv_heads:
        raise OscarError(f"{heads} heads cannot share {kv_heads} per-KV-head rotations evenly.")
    grouped = moved.reshape(*moved.shape[:-3], kv_heads, heads // kv_heads, *moved.shape[-2:])
    rotated = grouped @ rotation[:, None]  # [..., Hkv, g, n, d] @ [Hkv, 1, d, d]
    return rotated.reshape(moved.shape).movedim(-3, head_axis).contiguous()
