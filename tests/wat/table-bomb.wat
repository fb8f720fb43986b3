;; A hostile key module written as a core module in the WebAssembly text
;; format: Rust cannot emit `table.grow`, so the table growth bomb of the
;; hostile-guest suite is written by hand. `tests/all/hostile.rs` turns it
;; into a component of the `fief:key/key-module` world (wit-component) and
;; deploys it.
;;
;; `handle-call` grows its function table by 10 000 elements at a time,
;; forever; every other callback answers at once. Results of more than one
;; flat value are returned through memory at offset 16 (canonical ABI).
(module
  (memory (export "memory") 1)
  (table $t 1 funcref)
  (global $heap (mut i32) (i32.const 1024))

  ;; A bump allocator: enough for the arguments the host passes in.
  (func (export "cabi_realloc") (param $old i32) (param $old_size i32)
        (param $align i32) (param $size i32) (result i32)
    (local $p i32)
    (local.set $p
      (i32.and
        (i32.add (global.get $heap) (i32.sub (local.get $align) (i32.const 1)))
        (i32.xor (i32.sub (local.get $align) (i32.const 1)) (i32.const -1))))
    (global.set $heap (i32.add (local.get $p) (local.get $size)))
    (block $fits
      (br_if $fits
        (i32.le_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536))))
      (if (i32.eq
            (memory.grow
              (i32.add
                (i32.div_u (i32.sub (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
                           (i32.const 65536))
                (i32.const 1)))
            (i32.const -1))
        (then unreachable)))
    (local.get $p))

  ;; init: func(key: string, handoff-state: option<list<u8>>) -> result<_, string>
  (func (export "fief:key/lifecycle@0.1.0#init")
        (param i32 i32 i32 i32 i32) (result i32)
    (i32.store8 (i32.const 16) (i32.const 0))
    (i32.const 16))

  ;; handle-call: func(message: list<u8>) -> result<list<u8>, string>
  ;; The bomb: grow until the host refuses. The node traps the key there;
  ;; should growth ever just fail, answer ok(empty) so the test sees it.
  (func (export "fief:key/lifecycle@0.1.0#handle-call")
        (param i32 i32) (result i32)
    (loop $grow
      (br_if $grow
        (i32.ne (table.grow $t (ref.null func) (i32.const 10000)) (i32.const -1))))
    (i32.store8 (i32.const 16) (i32.const 0))
    (i32.store (i32.const 20) (i32.const 0))
    (i32.store (i32.const 24) (i32.const 0))
    (i32.const 16))

  ;; handle-cast: func(message: list<u8>)
  (func (export "fief:key/lifecycle@0.1.0#handle-cast") (param i32 i32))

  ;; handle-info: func(info: info)  (variant of two records, flattened)
  (func (export "fief:key/lifecycle@0.1.0#handle-info")
        (param i32 i64 i32 i32 i32))

  ;; handle-fence: func(deadline-ms: u32) -> fence-decision  (stop(""))
  (func (export "fief:key/lifecycle@0.1.0#handle-fence") (param i32) (result i32)
    (i32.store8 (i32.const 16) (i32.const 1))
    (i32.store (i32.const 20) (i32.const 0))
    (i32.store (i32.const 24) (i32.const 0))
    (i32.const 16))

  ;; handoff: func() -> option<list<u8>>  (none)
  (func (export "fief:key/lifecycle@0.1.0#handoff") (result i32)
    (i32.store8 (i32.const 16) (i32.const 0))
    (i32.const 16))

  ;; terminate: func(reason: stop-reason)
  (func (export "fief:key/lifecycle@0.1.0#terminate") (param i32 i32 i32))
)
