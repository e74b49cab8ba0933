# Sourced by the build scripts: checkout_commit DIR prints the commit of DIR when DIR is itself a git repository's
# top, else nothing (a plain tree inside another repository, such as a staging under .carry/, is not that
# repository's commit).
checkout_commit() {
  [[ "$(git -C "$1" rev-parse --show-toplevel 2>/dev/null)" == "$(cd "$1" && pwd -P)" ]] && git -C "$1" rev-parse HEAD
  return 0
}
