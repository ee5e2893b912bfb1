# Carrying a tar to the offline GPU host in parts (a call there brings about 60 MiB of files),
# for the *-bundle.sh scripts, which source this file and copy it beside their parts. The host
# side runs once per carried part: it keeps the part and installs once all have arrived.

# pack_parts TAR OUT PREFIX SCRIPT: OUT/PREFIXNN of 56 MiB, their SHA256 and count, SCRIPT and this file
pack_parts() {
    local tar=$1 out=$2 prefix=$3 script=$4
    split -b 56M -d -a 2 "$tar" "$out/$prefix"
    sha256sum "$tar" | cut -d' ' -f1 > "$out/SHA256"
    ls "$out/$prefix"* | wc -l > "$out/PARTS"
    cp "$script" "${BASH_SOURCE[0]}" "$out/"
    echo "carry $out/{$(basename "$script"),parts.sh,SHA256,PARTS} and one ${prefix}NN per call ($(cat "$out/PARTS") parts)"
}

# gather_parts HERE STORE PREFIX TAR: the parts this call brought (in HERE) kept in STORE; once
# all are there, joined into TAR and verified (status 0), else how many are there (status 1)
gather_parts() {
    local here=$1 store=$2 prefix=$3 tar=$4 have
    mkdir -p "$store"
    for p in "$here/$prefix"*; do [ -e "$p" ] && mv "$p" "$store/"; done
    have=$(ls "$store/$prefix"* 2>/dev/null | wc -l)
    if [ "$have" -lt "$(cat "$here/PARTS")" ]; then echo "have $have of $(cat "$here/PARTS") $prefix parts"; return 1; fi
    cat "$store/$prefix"* > "$tar"
    echo "$(cat "$here/SHA256")  $tar" | sha256sum -c -
    rm -f "$store/$prefix"*
}
