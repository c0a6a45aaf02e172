"""Seeded draws: the token a response takes at a position is a pure function of the request's
key (run seed, step, prompt index, sample index, phase), that position and the log-probs.

    token = argmax_v( logp[v] + gumbel(hash(key, position, v)) )      (Gumbel-max)

``logp`` are the contract's log-probs (temperature and truncation applied, -inf outside the
kept set), so the draw is exact sampling from the distribution the engine reports. The noise
uses integer ops, frexp and IEEE +, -, *, / only (no library log/exp, whose vector and scalar
paths may round differently): the same bits on every device, whatever the batch, its order,
the replica or the TP rank. Everything is tensor ops on the rows' device: no host sync, no
data-dependent shape (CUDA-graph capturable).

``pin`` makes a row one-hot in effect: the drawn token keeps its log-prob, every other entry
becomes -inf. The engine then takes that token by argmax (seeded requests run at engine
temperature 0, scheme.engine_temperature) and reports its log-prob unchanged.
"""
import torch

_MASK = 0xFFFFFFFF
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
# log(m) = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m-1)/(m+1), |s| <= 0.172: 10 terms reach 1e-17
_ATANH_COEFFS = [1.0 / (2 * k + 1) for k in range(10)]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) held in int64, without int64 overflow."""
    hi, lo = c >> 16, c & 0xFFFF
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_hash(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows, words] int64 keys (each word in [0, 2^32)) and [rows] positions -> [rows, 1]."""
    h = torch.full_like(positions, 0x9E3779B9).unsqueeze(1)
    for w in range(keys.shape[1]):
        h = _mix(h ^ keys[:, w:w + 1])
    return _mix(h ^ (positions.unsqueeze(1) & _MASK))


def uniforms(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 in (0, 1), 52 random bits each: (2 n + 1) / 2^53."""
    v = torch.arange(vocab, dtype=torch.int64, device=positions.device).unsqueeze(0)
    a = _mix(_mix(row_hash(keys, positions) ^ v))
    b = _mix(a ^ 0x68E31DA4)
    n = ((a >> 12) << 32) | b
    return (n * 2 + 1).to(torch.float64) * 2.0 ** -53


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64 by frexp + an odd series, in IEEE-exact elementary ops."""
    m, e = torch.frexp(x)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    poly = torch.full_like(z, _ATANH_COEFFS[-1])
    for c in reversed(_ATANH_COEFFS[:-1]):
        poly = poly * z + c
    return (s * 2.0) * poly + e * _LN2


def gumbel(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] standard Gumbel noise, float64, a function of (key, position, token id) only."""
    return -_log(-_log(uniforms(keys, positions, vocab)))


def draw(logp: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's token, Gumbel-max over its log-probs (-inf entries never win)."""
    return (logp.to(torch.float64) + gumbel(keys, positions, logp.shape[1])).argmax(dim=1)


def pin(logp: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, seeded: torch.Tensor) -> torch.Tensor:
    """Rows where ``seeded`` (bool [rows]) keep only their drawn token's log-prob (others -inf);
    the other rows are returned as they are."""
    token = draw(logp, keys, positions).unsqueeze(1)
    pinned = torch.full_like(logp, float("-inf")).scatter_(1, token, logp.gather(1, token))
    return torch.where(seeded.unsqueeze(1), pinned, logp)
