"""Readers for the folder layouts training and evaluation accept.

Training sources (speech / noise / music manifests, train and valid):

* the tim-enhancer corpus built by `enhancer-train corpus`: `ROOT/manifests/{speech,noise,music}_{train,valid}.tsv`
* a DNS-Challenge checkout: `datasets/clean/**` (speech, speaker from `reader_NNNN` in the name or
  else the sub-folder) and `datasets/noise/**`, split into train/valid by a hash of the speaker
  (speech) or the path (noise)
* Voicebank+DEMAND's training set: `clean_trainset_*_wav/` as speech and, for each noisy/clean pair
  of `noisy_trainset_*_wav/`, the noise the pair was made with (noisy minus clean, written once at
  16 kHz); the test set (`*_testset_*`, speakers p232 and p257) is never read, and speaker p228 is
  left out (this project evaluates on it)
* explicit manifests (`--speech`, `--noise`, `--music`, each `TRAIN[,VALID]`)

Evaluation pairs (noisy, clean):

* DNS-Challenge synthetic test set `test_set/synthetic/no_reverb/{noisy,clean}`, matched by `fileid_N`
* Voicebank+DEMAND `noisy_testset_wav/` and `clean_testset_wav/` (48 kHz), matched by name
* any two folders with the same file names (or `fileid_N` suffixes); clean may be absent
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from .manifests import DataError, Item, manifest_splits, read_manifest

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif")
CATEGORIES = ("speech", "noise", "music")


@dataclass
class TrainingData:
    """Item lists of each category; music is optional (an empty list)."""

    train: dict[str, list[Item]] = field(default_factory=dict)
    valid: dict[str, list[Item]] = field(default_factory=dict)
    description: str = ""
    # whole sources held out of both splits (`training.data.holdout`): the unseen-source dev set's material
    unseen: dict[str, list[Item]] = field(default_factory=dict)
    # audio decoded already, {(category, split): AudioSet} (`fit --shards`); empty: decode the items
    audio: dict = field(default_factory=dict)

    def decoded(self, cache_root=None, jobs: int | None = None, log=print) -> dict:
        """{(category, split): AudioSet or None} for the train and valid splits: the audio given
        already (`fit --shards`), else each list decoded into the 16 kHz cache (built once)."""
        from .audio_cache import cached_audio

        sets = {}
        for split, lists in (("train", self.train), ("valid", self.valid)):
            for cat in ("speech", "noise", "music"):
                items = lists.get(cat) or []
                if self.audio:
                    sets[cat, split] = self.audio.get((cat, split))
                else:
                    sets[cat, split] = cached_audio(items, f"{cat}_{split}", cache_root, jobs, log) if items else None
        return sets

    def check(self) -> TrainingData:
        for split, lists in (("train", self.train), ("valid", self.valid)):
            for cat in ("speech", "noise"):
                if not lists.get(cat):
                    raise DataError(f"no {cat} files for {split} ({self.description})")
            lists.setdefault("music", [])
        return self


# --------------------------------------------------------------------------- training sources
def corpus_layout(root, hold_out: bool = True) -> TrainingData:
    """`ROOT/manifests/{speech,noise,music}_{train,valid}.tsv` (music optional). With `hold_out`,
    the sources of `training.data.holdout.UNSEEN_SOURCES` leave both splits for `TrainingData.unseen`."""
    from .holdout import split_unseen

    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data folder not found: {root}")
    mdir = root / "manifests"
    if not mdir.is_dir():
        hint = ""
        if (root / "debian" / "materialize.sh").is_file() or (root / "speech" / "files.tsv").is_file():
            hint = (f" {root} is the shipped part of the data (speech only, no noise): the full corpus with manifests "
                    f"is built by {root / 'debian' / 'materialize.sh'} (several GB downloaded from Debian, minutes). "
                    f"To train now from what is here, see the quickstart in training/README.md: "
                    f"--speech {root / 'speech' / 'files.tsv'} with generated noise (enhancer-train synth-noise)")
        raise DataError(f"{root} has no manifests/ folder; expected manifests/{{speech,noise,music}}_{{train,valid}}.tsv "
                        "(build the corpus with `enhancer-train corpus --out DIR`; training/README.md, \"Training data\")." + hint)
    data = TrainingData(description=f"corpus {root}")
    for split in ("train", "valid"):
        lists = data.train if split == "train" else data.valid
        for cat in CATEGORIES:
            m = mdir / f"{cat}_{split}.tsv"
            if not m.exists():
                if cat == "music":
                    continue
                raise DataError(f"missing manifest {m}")
            items = read_manifest(m, root)
            if hold_out:
                items, held = split_unseen(items, cat, root)
                data.unseen.setdefault(cat, []).extend(held)
            lists[cat] = items
    return data.check()


def manifest_layout(speech: str, noise: str, music: str | None = None) -> TrainingData:
    """Each argument is `TRAIN_MANIFEST[,VALID_MANIFEST]`; without a valid manifest, the rows of a
    `split` column (`train` / `valid`, as in `files.tsv`) are used when it has both, else about
    5 % of the groups (speech) or files (noise, music) are held out by hash."""
    data = TrainingData(description=f"manifests speech={speech} noise={noise} music={music}")
    for cat, spec in (("speech", speech), ("noise", noise), ("music", music)):
        if not spec:
            continue
        parts = spec.split(",")
        if len(parts) > 2:
            raise DataError(f"--{cat} takes TRAIN[,VALID] manifests, got {spec!r}")
        if len(parts) == 2:
            train, valid = read_manifest(parts[0]), read_manifest(parts[1])
        elif {"train", "valid"} <= manifest_splits(parts[0]):
            train, valid = read_manifest(parts[0], split="train"), read_manifest(parts[0], split="valid")
        else:
            train = read_manifest(parts[0])
            train, valid = split_by_hash(train, by_group=(cat == "speech"))
        data.train[cat], data.valid[cat] = train, valid
    return data.check()


def dns_layout(root, valid_percent: float = 5.0) -> TrainingData:
    """DNS-Challenge `datasets/clean` and `datasets/noise` (root = the checkout or `datasets/`)."""
    ds = dns_datasets_dir(root)
    clean, noise = ds / "clean", ds / "noise"
    for d in (clean, noise):
        if not d.is_dir():
            raise DataError(f"DNS layout: missing folder {d}")
    speech = [Item(str(p), group=dns_speaker(p, clean)) for p in audio_files(clean)]
    noises = [Item(str(p), group=p.stem) for p in audio_files(noise)]
    if not speech:
        raise DataError(f"DNS layout: no audio files under {clean}")
    if not noises:
        raise DataError(f"DNS layout: no audio files under {noise}")
    data = TrainingData(description=f"DNS-Challenge {ds}")
    data.train["speech"], data.valid["speech"] = split_by_hash(speech, by_group=True, percent=valid_percent)
    data.train["noise"], data.valid["noise"] = split_by_hash(noises, by_group=False, percent=valid_percent)
    return data.check()


# VCTK / Voicebank speakers that evaluations use: p232 and p257 are the Voicebank+DEMAND test set,
# p228 this project's own held-out speaker (`training/README.md`, "Training data")
VB_TEST_SPEAKERS = ("p232", "p257")
VB_EVAL_SPEAKERS = ("p228",) + VB_TEST_SPEAKERS
_VB_SPEAKER = re.compile(r"^(p\d{3})_")


def vb_layout(root, noise_dir=None, valid_percent: float = 5.0, log=print) -> TrainingData:
    """Voicebank+DEMAND training set (`ROOT/clean_trainset_*_wav`, `ROOT/noisy_trainset_*_wav`, the
    same file names in both). Speech: the clean files. Noise: noisy minus clean for every pair (the
    DEMAND / babble noise at the pair's SNR), resampled to 16 kHz and written once to `noise_dir`
    (default: beside the audio cache). Both split by speaker (about `valid_percent` % valid).
    The test folders are never read; a training folder holding a test speaker (p232, p257) is refused
    and p228 (evaluated on in this project) is skipped."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"Voicebank+DEMAND root not found: {root}")
    if "testset" in root.name:
        raise DataError(f"{root} is the Voicebank+DEMAND test set: evaluation material, never used for training "
                        "(give the folder that holds clean_trainset_*_wav and noisy_trainset_*_wav)")
    clean_dirs = sorted(d for d in root.glob("clean_trainset*") if d.is_dir())
    if not clean_dirs:
        raise DataError(f"Voicebank+DEMAND layout: no clean_trainset_*_wav folder in {root}"
                        + (" (only the test set is there: it is never used for training)"
                           if any(root.glob("*testset*")) else ""))
    skipped_test = sorted(d.name for d in root.glob("*testset*"))
    if skipped_test:
        log(f"Voicebank+DEMAND: not reading {', '.join(skipped_test)} (the test set is never used for training)")
    noise_dir = Path(noise_dir) if noise_dir else vb_noise_dir(root)
    speech, noises, left_out = [], [], 0
    for cdir in clean_dirs:
        ndir = root / cdir.name.replace("clean_", "noisy_", 1)
        if not ndir.is_dir():
            raise DataError(f"Voicebank+DEMAND layout: {cdir} has no noisy counterpart {ndir}")
        for path in audio_files(cdir):
            m = _VB_SPEAKER.match(path.name)
            spk = m.group(1) if m else path.stem.split("_")[0]
            if spk in VB_TEST_SPEAKERS:
                raise DataError(f"{path}: speaker {spk} belongs to the Voicebank+DEMAND test set, yet is in a training "
                                "folder; refusing to train on it")
            if spk in VB_EVAL_SPEAKERS:
                left_out += 1
                continue
            noisy = ndir / path.relative_to(cdir)
            if not noisy.is_file():
                raise DataError(f"Voicebank+DEMAND layout: {path.name} has no noisy version in {ndir}")
            speech.append(Item(str(path), group=f"vctk {spk}"))
            noises.append((noisy, path, noise_dir / cdir.name / (str(path.relative_to(cdir).with_suffix("")) + ".flac"),
                           f"vb-noise {spk}"))
    if not speech:
        raise DataError(f"Voicebank+DEMAND layout: no usable clean files under {root}")
    if left_out:
        log(f"Voicebank+DEMAND: left out {left_out} files of speaker p228 (an evaluation speaker of this project)")
    made = 0
    for noisy, clean, out, _ in noises:
        if not out.is_file():
            _write_vb_noise(noisy, clean, out)
            made += 1
            if made % 1000 == 0:
                log(f"Voicebank+DEMAND: derived {made} noise files (noisy - clean) in {noise_dir}")
    if made:
        log(f"Voicebank+DEMAND: derived {made} noise files (noisy - clean) in {noise_dir}")
    noise_items = [Item(str(out), group=g) for _, _, out, g in noises]
    data = TrainingData(description=f"Voicebank+DEMAND {root}")
    data.train["speech"], data.valid["speech"] = split_by_hash(speech, by_group=True, percent=valid_percent)
    valid_speakers = {it.group.split()[1] for it in data.valid["speech"]}
    data.train["noise"] = [it for it in noise_items if it.group.split()[1] not in valid_speakers]
    data.valid["noise"] = [it for it in noise_items if it.group.split()[1] in valid_speakers]
    return data.check()


def vb_noise_dir(root, cache_root=None) -> Path:
    """Where the derived noise of a Voicebank+DEMAND root goes: `vb-noise/<md5 of the root>` beside
    the audio cache (`cache_root`, default ~/.cache/tim-enhancer/audio)."""
    from .audio_cache import default_cache_root

    key = hashlib.md5(str(Path(root).resolve()).encode()).hexdigest()[:12]
    return Path(cache_root or default_cache_root()).parent / "vb-noise" / key


def _write_vb_noise(noisy: Path, clean: Path, out: Path) -> None:
    """noisy - clean at 16 kHz (resampling is linear, so this is the resampled noise), as 24-bit FLAC."""
    import numpy as np
    import soundfile as sf

    from .audio_cache import AudioReadError, load_audio

    try:
        a, b = load_audio(noisy), load_audio(clean)
    except AudioReadError as e:
        raise DataError(f"Voicebank+DEMAND: cannot read {noisy} or {clean}: {e}") from None
    n = min(len(a), len(b))
    if abs(len(a) - len(b)) > 160:
        raise DataError(f"Voicebank+DEMAND: {noisy} and {clean} differ in length; not a noisy/clean pair")
    d = np.clip(a[:n] - b[:n], -1.0, 1.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    sf.write(str(part), d, 16000, subtype="PCM_24", format="FLAC")
    part.replace(out)


def dns_datasets_dir(root) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"DNS root not found: {root}")
    if (root / "datasets").is_dir():
        return root / "datasets"
    return root


_READER = re.compile(r"reader_(\d+)")


def dns_speaker(path: Path, base: Path) -> str:
    """`book_..._reader_06709_0.wav` -> "reader 06709"; otherwise the sub-folder under clean/."""
    m = _READER.search(path.name)
    if m:
        return f"reader {m.group(1)}"
    rel = path.relative_to(base)
    return " ".join(rel.parts[:-1]) or "clean"


def split_by_hash(items: list[Item], by_group: bool, percent: float = 5.0) -> tuple[list[Item], list[Item]]:
    """Deterministic train/valid split by an md5 of the group (or path). Never leaves either side
    empty when there are at least two keys."""
    def key(it: Item) -> str:
        return it.group if by_group else it.path

    def bucket(k: str) -> float:
        return int(hashlib.md5(k.encode()).hexdigest()[:8], 16) % 10000 / 100.0

    keys = sorted({key(it) for it in items})
    valid_keys = {k for k in keys if bucket(k) < percent}
    if not valid_keys and len(keys) > 1:
        valid_keys = {min(keys, key=bucket)}
    if len(valid_keys) == len(keys) and len(keys) > 1:
        valid_keys.discard(max(keys, key=bucket))
    train = [it for it in items if key(it) not in valid_keys]
    valid = [it for it in items if key(it) in valid_keys]
    return train, valid


def audio_files(folder) -> list[Path]:
    folder = Path(folder)
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in AUDIO_EXTENSIONS and p.is_file())


# --------------------------------------------------------------------------- evaluation pairs
@dataclass(frozen=True)
class Pair:
    name: str
    noisy: Path
    clean: Path | None


_FILEID = re.compile(r"fileid_(\d+)")


def paired_folders(noisy_dir, clean_dir=None) -> list[Pair]:
    """Pairs of files with the same name in both folders, or else the same `fileid_N`.
    Without `clean_dir` every noisy file is a pair with no reference."""
    noisy_dir = Path(noisy_dir)
    if not noisy_dir.is_dir():
        raise DataError(f"noisy folder not found: {noisy_dir}")
    noisy = audio_files(noisy_dir)
    if not noisy:
        raise DataError(f"no audio files in {noisy_dir}")
    if clean_dir is None:
        return [Pair(str(p.relative_to(noisy_dir)), p, None) for p in noisy]
    clean_dir = Path(clean_dir)
    if not clean_dir.is_dir():
        raise DataError(f"clean folder not found: {clean_dir}")
    clean = {str(p.relative_to(clean_dir)): p for p in audio_files(clean_dir)}
    if not clean:
        raise DataError(f"no audio files in {clean_dir}")
    by_name = [Pair(str(p.relative_to(noisy_dir)), p, clean.get(str(p.relative_to(noisy_dir)))) for p in noisy]
    if all(p.clean is not None for p in by_name):
        return by_name
    clean_ids = {}
    for p in clean.values():
        m = _FILEID.search(p.stem)
        if m:
            clean_ids[m.group(1)] = p
    pairs, unmatched = [], []
    for p in noisy:
        m = _FILEID.search(p.stem)
        ref = clean.get(str(p.relative_to(noisy_dir))) or (clean_ids.get(m.group(1)) if m else None)
        if ref is None:
            unmatched.append(p.name)
        else:
            pairs.append(Pair(str(p.relative_to(noisy_dir)), p, ref))
    if unmatched:
        raise DataError(f"{len(unmatched)} noisy file(s) in {noisy_dir} have no clean reference in {clean_dir} "
                        f"(by name or fileid_N), e.g. {unmatched[0]}")
    return pairs


def dns_test_pairs(root) -> list[Pair]:
    """DNS-Challenge synthetic test set without reverb: `[datasets/]test_set/synthetic/no_reverb`."""
    root = Path(root)
    candidates = [root / "datasets" / "test_set" / "synthetic" / "no_reverb", root / "test_set" / "synthetic" / "no_reverb",
                  root / "synthetic" / "no_reverb", root / "no_reverb"]
    for c in candidates:
        if (c / "noisy").is_dir() and (c / "clean").is_dir():
            pairs = paired_folders(c / "noisy", c / "clean")
            return sorted(pairs, key=lambda p: _fileid_order(p.name))
    raise DataError(f"no DNS synthetic test set under {root}: expected test_set/synthetic/no_reverb/{{noisy,clean}}")


def _fileid_order(name: str):
    m = _FILEID.search(name)
    return (0, int(m.group(1)), name) if m else (1, 0, name)


def voicebank_test_pairs(root) -> list[Pair]:
    """Voicebank+DEMAND test set: `noisy_testset_wav/` and `clean_testset_wav/` (same names)."""
    root = Path(root)
    noisy, clean = root / "noisy_testset_wav", root / "clean_testset_wav"
    for d in (noisy, clean):
        if not d.is_dir():
            raise DataError(f"Voicebank+DEMAND layout: missing folder {d}")
    return paired_folders(noisy, clean)
