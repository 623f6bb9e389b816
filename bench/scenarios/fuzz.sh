#!/usr/bin/env bash
# Scenario fuzz: every cargo-fuzz target at once on a many-core host (a GPU machine's CPUs), one
# prepared run that builds nothing there: dtans_decoder, df11_decoder (crates/codec/fuzz),
# container_reader (crates/format/fuzz), gguf_reader (crates/model/fuzz), request_parser
# (crates/server/fuzz); TARGETS to choose.
#   Inputs:  D: bin/<target>.xz (cargo fuzz build -O, ASan, stripped of debug info, xz),
#            container_reader.dict, request_parser.dict, corpus/<target>/ (seeds, optional),
#            corpus.tgz (an earlier call's corpora, optional); FUZZ_SECONDS (default 540); FORK
#            (libFuzzer -fork, default 3) a target, plus one more core that walks the targets in
#            turn, FUZZ_SECONDS/5 each, without fork (EXTRA=0: not): 5 x 3 + 1 = 16 workers.
#            Corpora in $W/fuzz/<target>/corpus: kept from an earlier call on the same machine,
#            else from D/corpus.tgz, else the seeds.
#   Peers:   none (what counts: executions, coverage, and no crash, leak, timeout or oom).
#   Outputs: $OUT/summary.txt (per target: workers, seconds, executions, the last coverage line,
#            artifacts and their reproductions), logs.tgz (last 200 lines of each log, crash
#            artifacts), corpus.tgz (when under 20 MB), up to five crash artifacts as they are.
#   Run:     D=DIR FUZZ_SECONDS=540 bash bench/scenarios/fuzz.sh [--dry-run]
#            (a short CPU run here: cargo fuzz run … -- -max_total_time=N, docs in RESULTS.md)
. "$(dirname "$0")/lib.sh"
S=${FUZZ_SECONDS:-540}; FORK=${FORK:-3}; EXTRA=${EXTRA:-1}
T=${TARGETS:-dtans_decoder df11_decoder container_reader gguf_reader request_parser}
FW=$W/fuzz
opts() { case $1 in
  container_reader) echo "-dict=$FW/container_reader.dict -max_len=8192" ;;
  request_parser) echo "-dict=$FW/request_parser.dict -max_len=4096" ;;
  *) echo "" ;; esac; }
if [ $DRY = 1 ] || [ $TINY = 1 ]; then
    [ $TINY = 1 ] && [ $DRY = 0 ] && { not_run fuzz "needs D with the fuzz binaries; no tiny mode"; exit 0; }
    for t in $T; do
        x "$FW/bin/$t" -fork="$FORK" -ignore_crashes=1 -max_total_time="$S" -rss_limit_mb=2048 -timeout=20 -print_final_stats=1 $(opts $t) -artifact_prefix="$FW/$t/art/" "$FW/$t/corpus"
    done
    exit 0
fi
D=${D:?D: the folder with bin/<target>.xz}
W=$FW; mkdir -p $W/bin $W/logs; SUM=$OUT/summary.txt
{ echo "fuzz: $(date -u +%FT%TZ) SECONDS=$S FORK=$FORK EXTRA=$EXTRA"
  lscpu | grep -E "^Model name|^CPU\(s\)" ; echo "nproc $(nproc); $(free -g | awk '/Mem/{print $2" GiB RAM"}')"; } > $SUM
cp $D/*.dict $W/ 2>/dev/null
[ -f $D/corpus.tgz ] && mkdir -p $W/carried && tar xzf $D/corpus.tgz -C $W/carried
for t in $T; do
  unxz_to $D/bin/$t.xz $W/bin/$t
  mkdir -p $W/$t/corpus $W/$t/art
  if [ -n "$(ls -A $W/$t/corpus)" ]; then src="kept on this machine"
  elif [ -d $W/carried/$t ] && [ -n "$(ls -A $W/carried/$t)" ]; then cp -r $W/carried/$t/. $W/$t/corpus/; src="from corpus.tgz"
  elif [ -d $D/corpus/$t ]; then cp -r $D/corpus/$t/. $W/$t/corpus/; src="seeds"
  else src="empty"; fi
  echo "$t: start corpus $(ls $W/$t/corpus | wc -l) files ($src); binary: $($W/bin/$t -runs=0 2>&1 | grep -cE 'INFO: (Seed|Loaded)') libFuzzer start lines" >> $SUM
  echo $(ls $W/$t/art | wc -l) > $W/$t/art0
done
# the fork runs, all at once
for t in $T; do
  ( s0=$(date +%s)
    timeout $((S + 60)) $W/bin/$t -fork=$FORK -ignore_crashes=1 -max_total_time=$S -rss_limit_mb=2048 -timeout=20 \
      -print_final_stats=1 $(opts $t) -artifact_prefix=$W/$t/art/ $W/$t/corpus > $W/logs/$t.log 2>&1
    echo "$? $(( $(date +%s) - s0 ))" > $W/$t/fork.rc ) &
done
# the 16th core: each target in turn, SECONDS/5 each, no fork
if [ "$EXTRA" = 1 ]; then
  ( for t in $T; do s0=$(date +%s)
      timeout $((S / 5 + 30)) $W/bin/$t -max_total_time=$((S / 5)) -rss_limit_mb=2048 -timeout=20 -print_final_stats=1 \
        $(opts $t) -artifact_prefix=$W/$t/art/ $W/$t/corpus > $W/logs/$t.extra.log 2>&1
      echo "$? $(( $(date +%s) - s0 ))" > $W/$t/extra.rc
    done ) &
fi
wait
# the summary
printf "%-17s %-26s %-24s %-14s %s\n" target fork "extra" worker-s executions >> $SUM
for t in $T; do
  read frc fw < $W/$t/fork.rc; fr=$(grep -oE '^#[0-9]+:' $W/logs/$t.log | tail -1 | tr -d '#:'); fr=${fr:-0}
  ew=0; er=0; erc=-
  if [ -f $W/$t/extra.rc ]; then read erc ew < $W/$t/extra.rc
    er=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' $W/logs/$t.extra.log | grep -oE '[0-9]+$' | tail -1)
    [ -n "$er" ] || er=$(grep -oE '^#[0-9]+' $W/logs/$t.extra.log | tail -1 | tr -d '#'); er=${er:-0}; fi
  line=$(grep -oE '^#[0-9]+: cov: [0-9]+ ft: [0-9]+ corp: [0-9]+ exec/s: [0-9]+ oom/timeout/crash: [0-9/]+' $W/logs/$t.log | tail -1)
  printf "%-17s %-26s %-24s %-14s %s\n" $t "${FORK}x${fw}s rc=$frc runs=$fr" "1x${ew}s rc=$erc runs=$er" \
    $((FORK * fw + ew)) $((fr + er)) >> $SUM
  echo "  last fork line: $line; corpus now $(ls $W/$t/corpus | wc -l) files, $(du -sh $W/$t/corpus | cut -f1)" >> $SUM
  arts=$(ls $W/$t/art | grep -E '^(crash|leak|timeout|oom|slow-unit)-' )
  if [ -n "$arts" ]; then echo "  ARTIFACTS ($(echo "$arts" | wc -l), $(cat $W/$t/art0) there before): $(echo $arts | head -c 2000)" >> $SUM
    for a in $(echo "$arts" | head -3); do
      timeout 30 $W/bin/$t -rss_limit_mb=2048 -timeout=20 $W/$t/art/$a > $W/logs/$t.repro.$a.txt 2>&1
      echo "  repro $a (rc $?):" >> $SUM; grep -vE '^(INFO|MS:|Running|Executed|\*\*\*)' $W/logs/$t.repro.$a.txt | head -12 | sed 's/^/    /' >> $SUM
    done
    mkdir -p $W/logs/art-$t; cp $W/$t/art/* $W/logs/art-$t/
  else echo "  no crash/leak/timeout/oom artifacts" >> $SUM; fi
done
n=0; for t in $T; do for a in $(ls $W/$t/art 2>/dev/null | head -5); do [ $n -lt 5 ] && cp $W/$t/art/$a $OUT/$t.$a && n=$((n+1)); done; done
for f in $W/logs/*.log; do tail -200 $f > $f.tail && mv $f.tail $f; done
tar czf $OUT/logs.tgz -C $W logs
mkdir -p $W/cpack; for t in $T; do ln -sfn $W/$t/corpus $W/cpack/$t; done
tar czhf $W/corpus.tgz -C $W/cpack $T
cs=$(stat -c %s $W/corpus.tgz); echo "corpus.tgz $cs bytes" >> $SUM
[ $cs -lt 20000000 ] && cp $W/corpus.tgz $OUT/
